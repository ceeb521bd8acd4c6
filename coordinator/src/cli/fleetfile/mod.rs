//! Fleet files and `flotilla plan`: what a rollout spec would make of a fleet, without a
//! coordinator.
//!
//! A fleet file is a JSON array of devices as their retained state would describe them:
//!
//! ```json
//! [
//!   {"id": "dev-001", "labels": {"env": "canary", "site": "ber"}, "hardware_id": "pi4"},
//!   {"id": "dev-002", "labels": {"env": "prod"}}
//! ]
//! ```
//!
//! `hardware_id` defaults to `any`; `labels` defaults to none. Every error names the entry's
//! index and field, and a device id may appear only once. The same file feeds
//! `flotilla simulate` (the `simulate` module).
//!
//! The output of `flotilla devices --json` is a fleet file as it stands: its other fields
//! (`online`, `installed`, `rollout`, `phase`, `reason`) are read past, and a device whose
//! `enrollment` is not accepted is left out, as the coordinator plans accepted devices only.
//! An accepted device listed as `accepted, no state since restart` is excluded from the plan
//! with the coordinator's reason (or refuses it under `unknown_devices = "refuse"`), as a
//! rollout created on the coordinator would be.
//! A staged spec that names a stored strategy is planned with that strategy's stages from
//! `--strategy-file` (`flotilla strategy show NAME` prints them), so `plan` stays offline
//! (docs/decisions/0018-cli-settings-and-offline-plan.md).
//!
//! Split by concern: `fleet` (the fleet and its devices), `parse` (reading a fleet file in one
//! streaming pass), `plan` (the `plan` command and the files it loads).

mod fleet;
mod parse;
mod plan;
#[cfg(test)]
mod tests;

pub use fleet::*;
pub use parse::{parse_fleet, parse_fleet_file};
pub use plan::*;
