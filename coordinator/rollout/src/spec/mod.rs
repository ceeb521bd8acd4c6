//! The rollout spec: the TOML an operator writes, validated into a [`RolloutSpec`].
//!
//! Parsing happens in two steps: serde reads the raw TOML into private structs that refuse
//! unknown fields (so a typo is an error, not a silently ignored setting), then validation turns
//! them into the public types, naming the field (a TOML path) and the value in every error. The
//! validated spec is serializable because it is stored with the rollout.
//!
//! A spec has the common keys (`name`, `release`, `select`), the rollout-wide policies (action
//! type, timeouts, retries, offline handling, rate, maintenance windows, soak), and exactly one
//! of four vocabularies, each from the system whose documents define it:
//!
//! - `[groups]`: Eclipse hawkBit deployment groups ([`GroupsSpec`]);
//! - `[partitions]`: Rancher Fleet partitions ([`PartitionsSpec`]);
//! - `[rolling]`: KubeFleet's RollingUpdate ([`RollingSpec`]);
//! - `[staged]`: KubeFleet staged update runs ([`StagedSpec`]), inline or naming a stored
//!   [`StagedStrategy`] that the service snapshots into the spec with
//!   [`RolloutSpec::resolve_strategy`].
//!
//! The planner compiles every vocabulary into the same [`crate::plan::Plan`];
//! `docs/rollout-spec.md` describes the grammar and the mapping.
//!
//! ```toml
//! name = "fw-2-4"
//! release = "fw-2.4.0"
//! select = "hw=pi4"
//! timeout = "30m"
//! [groups]
//! success = { threshold = "100%", action = "next" }
//! error = { threshold = "20%", action = "pause" }
//! [[groups.group]]
//! name = "canary"
//! select = "env=canary"
//! percent = 50
//! [[groups.group]]
//! name = "rest"
//! ```
//!
//! The code is split by concern: [`types`] holds the validated spec and its errors, `raw` the
//! TOML as written with the checks of single fields, `validate` the checks that turn one into
//! the other.

mod raw;
#[cfg(test)]
mod tests;
pub mod types;
mod validate;

pub use raw::rfc3339;
pub use raw::SITE_BUSY_KEYS;
pub use types::*;
