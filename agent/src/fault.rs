//! Fault injection for crash-safety tests: `FLOTILLA_FAULT=<point>` makes the agent abort the
//! process (as a kill -9 or a power cut would stop it) right after it persisted that point.
//!
//! Points are named `after-<state>` for every persisted state of an action: `after-accepted`,
//! `after-waiting`, `after-downloading` (at the start of each artifact), `after-verified`,
//! `after-staging`, `after-staged`, `after-activating`, `after-activated`, `after-confirming`,
//! `after-rolling-back`, and the final ones (`after-ready`, `after-applied`, `after-failed`,
//! `after-canceled`, `after-downloaded`). `docs/agent.md` lists them with what a restart does.
//!
//! Unset (the normal case) it does nothing. The variable is read once.

use std::sync::OnceLock;

/// The environment variable naming the fault point.
pub const FAULT_VAR: &str = "FLOTILLA_FAULT";

fn configured() -> Option<&'static str> {
    static POINT: OnceLock<Option<String>> = OnceLock::new();
    POINT
        .get_or_init(|| std::env::var(FAULT_VAR).ok().filter(|p| !p.is_empty()))
        .as_deref()
}

/// Aborts the process if `point` is the configured fault point.
pub fn point(point: &str) {
    if configured() == Some(point) {
        tracing::error!("{FAULT_VAR}={point}: aborting on purpose");
        std::process::abort();
    }
}
