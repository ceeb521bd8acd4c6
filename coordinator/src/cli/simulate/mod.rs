//! `flotilla simulate`: the real [`Engine`] driven in virtual time by scripted devices and
//! operator events, so an operator can see what a spec will do before touching a device.
//!
//! Nothing here decides anything about the rollout: the simulator only plays the devices and the
//! operator. It registers each fleet device with [`Engine::observe_state`], creates and starts the
//! rollout, and then runs an event loop over a virtual clock:
//!
//! - an [`Effect::Desired`] makes the device answer with its scripted reports (Accepted at once,
//!   then Ready or Failed after its delay, or nothing if it is silent), with increasing `seq`
//!   and the action id from the effect; a newer desired action or an [`Effect::Cancel`] drops the
//!   device's pending reports;
//! - a device scripted to go offline gets an `observe_state` with `online = false` at that time
//!   and sends nothing after it;
//! - operator events (approve, pause, resume, stop, next) call the engine at their time;
//! - [`Engine::tick`] runs at every simulated second that has something scheduled, and the clock
//!   jumps to the next event or [`Engine::next_timer`], whichever is first. Idle hours cost
//!   nothing.
//!
//! The run ends when the rollout is finished, stopped or failed, when nothing can happen any
//! more, or at the `until` horizon. The timeline is the engine's decision trace, in order.
//!
//! The outcomes file (TOML):
//!
//! ```toml
//! default = { ready_after = "30s" }
//! [[device]]
//! id = "dev-003"                 # or select = "env=canary"
//! fail_after = "20s"             # or ready_after = "2m", or silent = true
//! reason = "health check nginx failed"
//! offline_at = "5m"              # optional, from the start of the run
//! [[operator]]
//! at = "1h"
//! approve = "fw-2-4-canary"      # or command = "pause" | "resume" | "stop" | "next" (with
//!                                 # skip_approval = true: `rollout next --skip-approval`)
//! ```
//!
//! Split by concern: `base` (errors, defaults, times), `script` (how devices and operators
//! behave, from the script file), `run` (the simulation: the engine against simulated devices
//! and a clock), `command` (`flotilla simulate` and its report).

mod base;
mod command;
mod run;
mod script;
#[cfg(test)]
mod tests;

pub use base::*;
pub use command::*;
pub use run::*;
pub use script::*;
