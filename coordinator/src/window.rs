//! Maintenance windows: a five-field cron expression for when a window opens, how long it stays
//! open, and the IANA time zone the expression is read in. (Stub: always open.)

use crate::plan::WindowSpec;

/// A validated maintenance window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    pub spec: WindowSpec,
}

/// Why a window spec was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct WindowError(pub String);

impl Window {
    pub fn parse(spec: &WindowSpec) -> Result<Window, WindowError> {
        Ok(Window { spec: spec.clone() })
    }

    /// A window that never opens.
    pub fn never() -> Window {
        Window {
            spec: WindowSpec {
                cron: String::new(),
                duration: 0,
                tz: "UTC".into(),
            },
        }
    }

    /// Whether the window is open at `unix` (seconds).
    pub fn is_open(&self, _unix: u64) -> bool {
        true
    }

    /// The first time at or after `unix` when the window is open, looking at most 366 days ahead.
    pub fn next_open(&self, unix: u64) -> Option<u64> {
        Some(unix)
    }
}
