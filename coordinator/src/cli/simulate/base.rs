//! What every part of the simulator shares: its errors, its defaults, and times as offsets.

use std::path::PathBuf;

use crate::cli::fleetfile::FleetError;
use flotilla_rollout::engine::EngineError;

/// Where the virtual clock starts unless `--start` says otherwise (2027-01-15T08:00:00Z).
pub const DEFAULT_START: u64 = 1_800_000_000;

/// How long a run may last in virtual time unless `--until` says otherwise.
pub const DEFAULT_UNTIL: u64 = 30 * 86_400;

/// What every device does when there is no outcomes file.
pub const DEFAULT_READY_AFTER: u64 = 30;

/// Most rounds of events and ticks at one virtual second before the run is declared stuck.
pub(super) const MAX_ROUNDS_PER_SECOND: usize = 10_000;

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    Files(#[from] FleetError),
    #[error("cannot read outcomes file {path}: {source}")]
    ReadOutcomes {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("outcomes file: {0}")]
    Outcomes(String),
    #[error("--{flag} {value:?}: {reason}")]
    Flag {
        flag: &'static str,
        value: String,
        reason: String,
    },
    #[error("the simulated coordinator refused the rollout: {0}")]
    Engine(#[from] EngineError),
    #[error("the engine kept acting at +{} without time passing; giving up", offset(*at))]
    Stuck { at: u64 },
}

/// `+HH:MM:SS` from the start (hours grow past 24).
pub fn offset(secs: u64) -> String {
    format!(
        "+{:02}:{:02}:{:02}",
        secs / 3600,
        (secs / 60) % 60,
        secs % 60
    )
}

/// Parses `YYYY-MM-DDTHH:MM:SS` followed by `Z` or `±HH:MM` (fractions of a second ignored).
pub fn parse_rfc3339(text: &str) -> Result<u64, String> {
    flotilla_rollout::spec::rfc3339(text)
        .ok_or_else(|| "expected an RFC 3339 time after 1970, like 2027-01-04T09:00:00Z".to_owned())
}
