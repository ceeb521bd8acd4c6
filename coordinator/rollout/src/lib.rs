//! # flotilla-rollout
//!
//! The rollout logic of flotilla, free of I/O: what a rollout spec means, which devices each
//! group gets, and how a rollout moves when devices report, operators command and time passes.
//! No async runtime, no MQTT, no store and no clock: time comes in as an argument (`now`, Unix
//! seconds) and time zone rules through the [`ZoneSource`](zoneinfo::ZoneSource) trait, so the
//! service, `flotilla plan`, `flotilla simulate` and the tests all run the same code.
//!
//! ```text
//!  spec.toml ──RolloutSpec::from_toml──> RolloutSpec          (spec: four vocabularies,
//!                                            │                  selector, window, ramp, duration)
//!  fleet snapshot (FleetDevice[]) ──┐        │
//!  device groups ───────────────────┼──planner::plan──> Plan   (plan: ordered PlannedGroups with
//!  release hardware ids ────────────┘        │                  pace, conditions, gates; policies)
//!                                            ▼
//!  reports, states, commands, tick(now) ──> Engine ──> Vec<Effect>
//!                                            │          Save, Desired, Cancel, Rollback,
//!                                            │          Approval, Forget, Status, Trace
//!                      conditions: group counts -> next | pause | stop | rollback
//! ```
//!
//! The caller applies the effects in order (the coordinator's service: persist, then sign and
//! publish; the simulator: advance virtual time and script device outcomes).
//!
//! Layout:
//! - [`spec`]: the TOML rollout spec in hawkBit, Rancher Fleet, KubeFleet rolling and KubeFleet
//!   staged vocabularies, validated with errors that name the field; stored staged strategies.
//! - [`selector`]: label selectors (`env=a`, `hw in (pi4,cm4)`, `!beta`).
//! - [`planner`]: spec + fleet -> [`plan::Plan`], a pure function.
//! - [`plan`]: the compiled plan every vocabulary becomes, and its policies.
//! - [`conditions`]: success and error conditions over a group's counts.
//! - [`window`]: cron maintenance windows in a time zone (jiff's, built from TZif bytes), and
//!   the UTC window an install carries to the agent; [`zoneinfo`]: the system's zone files
//!   behind [`zoneinfo::ZoneSource`], the crate's only file access.
//! - [`ramp`]: the rate ramp for starting devices.
//! - [`duration`]: `30s`, `15m`, `12h`, `7d`, `2h30m`; [`text`]: counts and states in words
//!   ("1 device", "has failed").
//! - [`engine`]: the sans-I/O state machine of rollouts, groups and devices.
//!
//! ```
//! use flotilla_rollout::planner::{self, FleetDevice};
//! use flotilla_rollout::spec::RolloutSpec;
//! use flotilla_rollout::zoneinfo::SystemZones;
//!
//! let spec = RolloutSpec::from_toml(
//!     "name = \"fw-2-4\"\nrelease = \"fw-2.4.0\"\n[groups]\ncount = 2\n",
//!     &SystemZones,
//! )
//! .unwrap();
//! let fleet: Vec<FleetDevice> = (1..=4)
//!     .map(|i| FleetDevice {
//!         id: format!("dev-{i}"),
//!         labels: Default::default(),
//!         hardware_id: "pi4".into(),
//!     })
//!     .collect();
//! let plan = planner::plan(&spec, &fleet, &[], &[]).unwrap();
//! assert_eq!(plan.groups.len(), 2);
//! ```

pub mod conditions;
pub mod duration;
pub mod engine;
pub mod plan;
pub mod planner;
pub mod ramp;
pub mod selector;
pub mod spec;
pub mod text;
pub mod window;
pub mod zoneinfo;
