//! The decision trace: every decision as words for people and as fields for programs
//! ([`TraceEntry`], whose JSON schema is in `docs/protocol.md`).
//!
//! A call site names the kind of decision and what it is about:
//! `self.record(now, Decision::new(TraceKind::GroupStarted, message).group(&name), out)`.
//! A plain `String` still records, as a [`TraceKind::Note`] with words only.

use flotilla_protocol::control::{Compared, TraceEntry, TraceKind};

/// A decision on its way into the trace; `Rollout::record` (`advance.rs`) adds the time and
/// the rollout.
#[derive(Debug, Clone)]
pub(crate) struct Decision(TraceEntry);

impl Decision {
    pub fn new(kind: TraceKind, message: impl Into<String>) -> Decision {
        Decision(TraceEntry::new(0, "", message).kind(kind))
    }

    pub fn group(self, group: &str) -> Decision {
        Decision(self.0.group(group))
    }

    pub fn device(self, device: &str) -> Decision {
        Decision(self.0.device(device))
    }

    /// The operator who asked (leave it out for the engine's own decisions).
    pub fn by(self, by: &str) -> Decision {
        Decision(self.0.by(by))
    }

    pub fn compared(self, compared: Compared) -> Decision {
        Decision(self.0.compared(compared))
    }
}

impl Decision {
    /// The entry for rollout `rollout` at `at`.
    pub fn entry(self, at: u64, rollout: &str) -> TraceEntry {
        let mut entry = self.0;
        entry.at = at;
        entry.rollout = rollout.to_owned();
        entry
    }
}

impl From<String> for Decision {
    fn from(message: String) -> Decision {
        Decision(TraceEntry::new(0, "", message))
    }
}
